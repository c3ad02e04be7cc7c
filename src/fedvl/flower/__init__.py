"""Run any fedvl algorithm on Flower (simulation engine or SuperLink/SuperNodes).

Modules: `records` (fedvl Message <-> Flower RecordDict), `server_app` / `client_app` (the
generic ServerApp and ClientApp: `fedvl.flower.server_app:app`, `fedvl.flower.client_app:app`),
`transport` (the round driver's messages over a Grid), `node` (a SuperNode's own partition),
`node_state` (a node's client state on its own disk, for resumed runs), `simulate`
(`fedvl flower simulate`), `deploy` and `local` (SuperLink/SuperNode commands, app
directories, TLS certificates, loopback federations), `options` (`ServerOptions`, the
Flower-only settings). The commands, `fedvl flower ...`, are in `fedvl.cli.flower`. See
docs/flower.md. Importing this package does not import flwr.
"""
