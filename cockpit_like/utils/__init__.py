"""Schedules and preset configurations."""

from cockpit_like.utils import configuration, schedules

__all__ = ["configuration", "schedules"]
