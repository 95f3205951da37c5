"""Video jobs: their rows behind one `JobStore` interface (SQLite by default, PostgreSQL when
several servers share them) and their files on the output store (`VideoFiles`)."""
