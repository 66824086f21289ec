"""The borrowd controller: control laws, supervisor, the daemon loop and the CLI."""
