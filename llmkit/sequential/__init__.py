"""The sequential translation server: the C++ tutorial's server in Python (the course's "before")."""
