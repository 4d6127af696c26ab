"""Scripts that run inside engine subprocesses (Miles/SGLang code on sys.path); never imported by v4rl at startup."""
