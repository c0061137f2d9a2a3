"""Admission, dispatch and replies: from a validated request to the stream and back."""
