"""The fleet: replicas that publish where their KV is (`replica_events`), and the router in front of them
(`tiercache route`) that sends each request where its prefix lives."""
