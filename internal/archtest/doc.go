// Package archtest holds the test that enforces the package map of
// docs/design/packages.md: which km0 package may import which, which may
// link a broker client, and the known exceptions the map still tolerates,
// each with the change that removes it. It also logs the layout's metrics
// (issue 22) and bounds the exported names of the public packages that no
// other package and no example uses.
package archtest
