package pgtest

import (
	"fmt"
	"os"

	"github.com/km0/km0/internal/pgcluster"
)

// RunWithCluster is for TestMain of a package whose tests need a private
// cluster: it starts one with opts, points URL (and so NewSchema,
// NewDatabase) at it through KM0_TEST_DATABASE_URL, runs the tests, stops the
// cluster and returns the exit code. A cluster that does not start fails the
// package with the reason (exit code 1), never a skip.
func RunWithCluster(m interface{ Run() int }, opts pgcluster.Options) int {
	c, err := pgcluster.Start(opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "FAIL: a private PostgreSQL cluster is required:", err)
		return 1
	}
	defer c.Stop()
	if err := os.Setenv("KM0_TEST_DATABASE_URL", c.URL); err != nil {
		fmt.Fprintln(os.Stderr, "FAIL:", err)
		return 1
	}
	return m.Run()
}
