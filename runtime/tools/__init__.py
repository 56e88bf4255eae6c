"""The `jaxserve` command (cli.py) and its subcommands other than `serve`: compile, bench (offline,
`bench serve`, `bench soak`, their workloads), selfcheck, env (collect_env.py)."""
