"""The server's default limits, importable without the serve extra (the CLI's --help shows them)."""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20   # 4 MiB: a 128K-token prompt as text or as token ids fits several times
