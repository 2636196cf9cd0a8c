"""The command-line programs. Each module has `main(argv=None) -> int`; they are installed as
`pretrain-<name>` ([project.scripts] in pyproject.toml), and `python tools/<name>.py` runs the
same `main` from a checkout."""
