"""Digit tasks (copy, reverse, sort, add) in verl's dataset layout, and their rule-based rewards."""
