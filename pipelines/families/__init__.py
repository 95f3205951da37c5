"""Model families: what each network is and how it runs, one file per family, and the small
rules a family picks (`policies`)."""
