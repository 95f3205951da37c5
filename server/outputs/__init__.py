"""Where generated files go: an `OutputStore` (a local directory by default, an S3-compatible
bucket when several servers share their outputs), and the files of images and videos on it."""
