"""The dashboard Space: charts a deltasync bucket from its manifest, metrics and file headers."""
