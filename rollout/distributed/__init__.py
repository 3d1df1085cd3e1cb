"""Tensor parallelism's process-group handle, passed explicitly to the layers that communicate."""

from rollout.distributed.group import TPGroup

__all__ = ["TPGroup"]
