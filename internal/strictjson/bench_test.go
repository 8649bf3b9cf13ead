package strictjson_test

import (
	"encoding/json"
	"testing"

	"github.com/km0/km0/internal/strictjson"
)

// benchBody is an order as POST /comandes takes it; the benchmarks compare
// strict decoding with encoding/json alone.
var benchBody = []byte(`{"id":"P-2026-000123","client":"anna","mercat":"girona","linies":[{"producte":"formatge-curat","quantitat":2,"preu_centims":1450},{"producte":"carbasso","quantitat":1,"preu_centims":300}],"adreca_lliurament":{"ciutat":"Girona","codi_postal":"17001"}}`)

func BenchmarkStrict(b *testing.B) {
	for b.Loop() {
		var o order
		if err := strictjson.Unmarshal(benchBody, &o); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkStd(b *testing.B) {
	for b.Loop() {
		var o order
		if err := json.Unmarshal(benchBody, &o); err != nil {
			b.Fatal(err)
		}
	}
}
