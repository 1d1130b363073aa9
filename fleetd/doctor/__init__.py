"""`fleetd doctor`: is this account, this host and this config ready for `fleetd run`?"""
