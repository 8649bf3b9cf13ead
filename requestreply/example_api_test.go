package requestreply_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/inbox"
	"github.com/km0/km0/migrate"
	"github.com/km0/km0/requestreply"
)

// The table of pending calls a transport's client keeps: a reply read from
// the wire is Delivered to the request waiting for its correlation id, Late
// when none waits (it timed out), or Dropped when a ReplyVerifier refuses
// its signature (counted under MetricRepliesDropped with motiu
// ReasonUnsigned or ReasonBadSignature).
func ExampleCalls_Receive() {
	calls := requestreply.NewCalls(nil) // no signing key: every reply accepted
	wait, err := calls.Add("corr-1", "P-2026-000123", "respostes.a1")
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, corr := range []string{"corr-1", "corr-2"} {
		var got requestreply.Received = calls.Receive(corr, requestreply.Reply{Body: []byte(`{"autoritzada":true}`)})
		switch got {
		case requestreply.Delivered:
			fmt.Println(corr, "delivered:", string((<-wait).Body))
		case requestreply.Late:
			fmt.Println(corr, "late")
		case requestreply.Dropped:
			fmt.Println(corr, "dropped")
		}
	}
	fmt.Println("motiu of a dropped reply:", requestreply.ReasonUnsigned, "or", requestreply.ReasonBadSignature)
	// Output:
	// corr-1 delivered: {"autoritzada":true}
	// corr-2 late
	// motiu of a dropped reply: sense_signatura or signatura_incorrecta
}

// A server that answers with Idempotent runs its TxHandler once per request
// id and answers repeats from respostes_desades; it purges the stored
// responses past the inbox's retention beside inbox.Purge, or the table
// grows without bound.
func ExamplePurgeResponses() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://127.0.0.1/pagaments")
	if err != nil {
		log.Fatal(err)
	}
	var authorise requestreply.TxHandler = func(ctx context.Context, tx pgx.Tx, req *requestreply.Request) ([]byte, error) {
		return []byte(`{"autoritzada":true}`), nil
	}
	handler := requestreply.Idempotent(pool, migrate.Names{}, "pagaments.autoritzacio", authorise)
	_ = handler // what amqprr.ServerConfig.Handler or kafkarr.ServerConfig.Handler takes
	for range time.Tick(time.Hour) {
		n, err := requestreply.PurgeResponses(ctx, pool, migrate.Names{}, inbox.RetentionDefault)
		if err != nil {
			log.Print(err)
			continue
		}
		log.Printf("purged %d stored responses", n)
	}
}
