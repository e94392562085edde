"""What crosses the wire between the router and a worker replica. Imports no JAX: the router
uses it to build requests and read replies."""
