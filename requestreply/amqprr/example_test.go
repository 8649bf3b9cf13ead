package amqprr_test

import (
	"context"
	"encoding/json"
	"errors"
	"log"

	"github.com/km0/km0/requestreply"
	"github.com/km0/km0/requestreply/amqprr"
	"github.com/km0/km0/transport/amqp"
)

// pagaments answers card authorisations on pagaments.autoritzacions;
// comandes asks, with the order id as request id so a retry is safe.
func Example() {
	ctx := context.Background()
	conn, err := amqp.Dial(ctx, amqp.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	srv, err := amqprr.NewServer(ctx, amqprr.ServerConfig{Conn: conn, Handler: func(ctx context.Context, req *requestreply.Request) ([]byte, error) {
		var in struct {
			OrderID string `json:"comanda_id"`
			Amount  int    `json:"import_centims"`
		}
		if err := requestreply.DecodeJSON(req.Body, &in); err != nil {
			return nil, err // error reply: "bad request: malformed JSON: …"
		}
		return json.Marshal(map[string]any{"autoritzada": in.Amount < 100_000})
	}})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Run(ctx) }()

	cl, err := amqprr.NewClient(ctx, amqprr.ClientConfig{Conn: conn})
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	resp, err := cl.Request(ctx, amqprr.QueueDefault, "autoritzacio-P-2026-000123",
		[]byte(`{"comanda_id":"P-2026-000123","import_centims":4250}`))
	switch {
	case errors.Is(err, requestreply.ErrTimeout):
		log.Print("no answer in 5 s: retry with the same request id")
	case err != nil:
		log.Fatal(err)
	default:
		log.Printf("%s", resp)
	}
}
