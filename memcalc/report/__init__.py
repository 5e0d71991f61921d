"""Renderers: rich tables, JSON, markdown. Thin: they read an Estimate and print."""
