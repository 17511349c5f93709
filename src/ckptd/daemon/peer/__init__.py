"""The peer tier: replicas of a node's newest local step on other daemons of the job,
sent over authenticated gRPC on TCP, and fetched back by a node that lost its disk."""
