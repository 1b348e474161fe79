"""Backends start and stop replica processes; the endpoint manager decides how many and where."""
