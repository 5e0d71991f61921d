"""The cost model: pure functions over a resolved `Run`. Never imports typer, rich or torch; never prints."""
