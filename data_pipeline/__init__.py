"""data_pipeline package."""
