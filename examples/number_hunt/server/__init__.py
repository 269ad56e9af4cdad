# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Number Hunt environment server components."""

from .number_hunt_environment import NumberHuntEnvironment

__all__ = ["NumberHuntEnvironment"]
