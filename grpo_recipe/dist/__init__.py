"""Distributed plumbing: the process group and named collectives (group.py), a stopped rank named within the
collective timeout (liveness.py), where the store and backend listen (rendezvous.py), exit codes and the rank
environment (env.py, standard library only: launchers import it), build locks (buildlock.py).
Imports config only; knows nothing of models."""
