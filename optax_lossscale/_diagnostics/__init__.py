"""Diagnostics: why steps skip, said in words (`skip_report`), and where
float16 overflows (`find_overflow`). Builds on `_core` and `_access`."""
