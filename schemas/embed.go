// Package schemas holds the JSON Schema of every event km0 publishes, one file
// per tipus and versio: <tipus>/v<N>.json (for example
// comanda.creada/v2.json). Package schema compiles them; `km0 schema check`
// compares them with a git revision so that an incompatible change under the
// same versio cannot land.
//
// The schemas are tolerant readers: they never set additionalProperties to
// false, so a producer may add optional fields without breaking anyone.
package schemas

import "embed"

// FS holds every <tipus>/v<N>.json file of this directory.
//
//go:embed */*.json
var FS embed.FS
