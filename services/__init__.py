"""The application layer and the three roles: router, verifier and drafter (each imports only common/ and protos/),
and the packages that put them to work: cli, serving, bench and build."""
