"""The HTTP gateway: validates requests, enqueues them on Redis Streams and waits for replies.
Never imports torch and never touches a GPU."""
