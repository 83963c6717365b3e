"""Schedules, preset configurations and optimizer helpers."""

from cockpit_like.utils import configuration, optim, schedules

__all__ = ["configuration", "optim", "schedules"]
