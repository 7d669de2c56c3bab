"""The plain data both sides share, on the bottom floor (docs/architecture.md): keys and KV layouts
(`keys`, `layout`), plans, jobs, reports, failures and link limits (`plan`), how work is split into jobs and
whose jobs still run (`jobs`), what a worker found on disk (`scan`), and what crosses the connector's sides
(`connector`). Nothing here imports tiercache above the foundation (`errors`, `registry`)."""
