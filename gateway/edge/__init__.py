"""The HTTP edge: the server's limits against untrusted clients and the checks every route shares."""
