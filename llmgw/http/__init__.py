"""HTTP for the relay hops: the upstream connection pool and the relay to a client."""
