"""Renderers (rich tables, one module per command) and output formats (JSON, JUnit, CSV, PNG); they show results, they never decide them."""
