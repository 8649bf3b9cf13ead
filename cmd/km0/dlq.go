package main

import "github.com/km0/km0/internal/dlqcli"

func init() {
	register(&command{name: "dlq", summary: "list, show, replay and purge dead letters; run the DLQ indexer (km0 dlq help)", run: dlqcli.Main})
}
