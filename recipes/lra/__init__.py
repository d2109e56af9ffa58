"""Long Range Arena (paper Sec. 4.1, Table 1): data, the paper's LRA model and its training (see README.md)."""
