"""Start-up checks that look beyond the flags: the machine, the files, user hooks imported and their
signatures, installed backends (`preflight`), and the dry run that prints the plan without launching
(`dry_run`). Imports the config and the components whose inputs it checks; only the CLI imports it."""
