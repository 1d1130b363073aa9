"""High availability: several `fleetd run` on different hosts, one leader by lease (DESIGN.md, "High availability")."""
