"""What is measured and reported about runs: bench comparisons (`comparison`), HTML reports
(`html_report`), client shift (`mmd`, `shift`), membership inference (`membership`), figures
(`plots`)."""
