"""Thin Typer layer over the qualify library: parse options, call one function, render its result."""
