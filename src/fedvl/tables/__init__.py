"""The table specs `fedvl reproduce` runs: one YAML file per paper (or fedvl) table."""
