"""Programs behind the `graphlm` command: render, params, plan, stats, train, generate."""
