"""The C++ CPU library's Python side: loading and checking it, the pool, its jobs."""
