package cdc_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/km0/km0/relay"
	"github.com/km0/km0/relay/cdc"
)

// The defaults a zero Config gets (New applies WithDefaults), and the limit
// of BatchSize.
func ExampleConfig_WithDefaults() {
	c := cdc.Config{}.WithDefaults()
	fmt.Println("ApplicationName", c.ApplicationName == cdc.ApplicationNameDefault, c.ApplicationName)
	fmt.Println("StatusInterval", c.StatusInterval == cdc.StatusIntervalDefault, c.StatusInterval)
	fmt.Println("ReleaseCheck", c.ReleaseCheck == cdc.ReleaseCheckDefault, c.ReleaseCheck)
	fmt.Println("BatchSize at most", cdc.BatchSizeMax)
	// Output:
	// ApplicationName true km0-relay-cdc
	// StatusInterval true 1s
	// ReleaseCheck true 1s
	// BatchSize at most 10000
}

// The metrics a relay with Config.Metrics set exports, for dashboards and
// alerts.
func Example_metrics() {
	for _, name := range []string{cdc.MetricActive, cdc.MetricSlotLagBytes, cdc.MetricSlotLagSeconds, cdc.MetricSlotRetained} {
		fmt.Println(name)
	}
	// Output:
	// km0_relay_cdc_active
	// km0_relay_cdc_slot_lag_bytes
	// km0_relay_cdc_slot_lag_seconds
	// km0_relay_cdc_slot_retained_wal_bytes
}

// New refuses an invalid Config (ErrConfig) before it connects; Run fails
// with ErrSetup when the database is not set up for CDC (wal_level, the
// publication, the slot). SlotLag reads the slot's state, for a health page.
func ExampleRelay_SlotLag() {
	r, err := cdc.New(cdc.Config{Config: relay.Config{DatabaseURL: "postgres://127.0.0.1/app"}})
	if errors.Is(err, cdc.ErrConfig) {
		log.Fatal(err)
	}
	if err := r.Run(context.Background()); errors.Is(err, cdc.ErrSetup) {
		log.Fatal("run km0 migrate --cdc first: ", err)
	}
	var lag cdc.SlotLag
	if lag, err = r.SlotLag(context.Background()); err == nil && !lag.Active {
		fmt.Printf("slot inactive, %d bytes retained\n", lag.RetainedBytes)
	}
}
