"""Example plugin engines: how a team brings its own trainer (and its own loss code) to qualify."""
