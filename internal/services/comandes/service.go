package comandes

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/km0/km0/consumer"
	"github.com/km0/km0/internal/services/svc"
	"github.com/km0/km0/internal/strictjson"
	"github.com/km0/km0/outbox"
	"github.com/km0/km0/outcome"
)

// ErrRefused is wrapped by an Authorizer's error when the card was refused:
// POST /comandes answers 402. Any other Authorizer error answers 503.
var ErrRefused = errors.New("comandes: payment refused")

// ErrAuthConflict is wrapped by an Authorizer's error when pagaments already
// holds an authorisation of this order id for another amount (someone asked
// first with another body): POST /comandes answers 409 and stores nothing
// under the Idempotency-Key, since no retry of the same request can succeed.
var ErrAuthConflict = errors.New("comandes: pagaments holds another authorisation for this order")

// Authorizer asks pagaments to authorise the card before an order is
// accepted (request/reply on pagaments.autoritzacions). It returns nil when
// approved, an error wrapping ErrRefused when refused, one wrapping
// ErrAuthConflict for a conflict, and any other error when pagaments did not
// answer (timeout, broker down).
type Authorizer interface {
	Authorize(ctx context.Context, orderID string, totalCents int64) error
}

// MaxBodyBytesDefault is the largest POST /comandes body accepted (413 above).
const MaxBodyBytesDefault = 64 << 10

// Config configures a Service.
type Config struct {
	Pool *pgxpool.Pool // km0_comandes, migrated; required
	// Outbox writes events; default outbox.New(outbox.Config{}) (public.outbox).
	Outbox *outbox.Outbox
	// Authorizer, if set, is asked before an order is accepted.
	Authorizer Authorizer
	// Markets accepted in mercat; default MarketsDefault.
	Markets []string
	// Products is the catalogue: an order line whose producte is not in it
	// is refused with 400 naming the line, before anything is stored or
	// authorised (inventari could not serve it). Stock is not checked here:
	// an order of a known product that runs out is accepted and inventari
	// dead-letters it. Default ProductsDefault.
	Products []string
	// MaxBodyBytes; default MaxBodyBytesDefault.
	MaxBodyBytes int64
	// KeyLease is how long a request holds its Idempotency-Key while it runs
	// (authorisation included; the request gives up at its end). A retry of
	// a request whose process died waits at most this long, then runs
	// afresh. It must exceed the authorisation's timeout. Default
	// KeyLeaseDefault.
	KeyLease time.Duration
	// OperatorToken, if set, is accepted as "Authorization: Bearer <token>"
	// on GET /comandes/{id} and POST /comandes/{id}/cancellacio for every
	// order (km0 up reads it from OperatorTokenEnv). Empty, the default:
	// operator access is off and only each order's capability opens it.
	OperatorToken string
	Logger        *slog.Logger // default slog.Default()
}

// Service is the comandes service. It is safe for concurrent use.
type Service struct {
	cfg      Config
	products map[string]bool // cfg.Products
	flights  flights         // Idempotency-Keys held by requests of this process
	operator []byte          // SHA-256 of cfg.OperatorToken; nil: operator access off
	dummy    []byte          // compared with when an order has no capability (authorize)
}

// New returns a Service. It fails without a pool.
func New(cfg Config) (*Service, error) {
	if cfg.Pool == nil {
		return nil, errors.New("comandes: Config.Pool is required")
	}
	if cfg.Outbox == nil {
		cfg.Outbox = outbox.New(outbox.Config{})
	}
	if len(cfg.Markets) == 0 {
		cfg.Markets = MarketsDefault
	}
	if len(cfg.Products) == 0 {
		cfg.Products = ProductsDefault
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = MaxBodyBytesDefault
	}
	if cfg.KeyLease <= 0 {
		cfg.KeyLease = KeyLeaseDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	products := make(map[string]bool, len(cfg.Products))
	for _, p := range cfg.Products {
		products[p] = true
	}
	s := &Service{cfg: cfg, products: products, dummy: make([]byte, sha256.Size)}
	_, _ = rand.Read(s.dummy)
	if cfg.OperatorToken != "" {
		h := sha256.Sum256([]byte(cfg.OperatorToken))
		s.operator = h[:]
	}
	return s, nil
}

// Created is the answer to a successful POST /comandes.
type Created struct {
	ID         string `json:"id"`
	State      string `json:"estat"`
	TotalCents int64  `json:"import_centims"`
	EventID    string `json:"id_esdeveniment"`
	Version    int    `json:"versio"`
	// Capability is the order's capacitat: the customer's credential for
	// GET /comandes/{id} and its cancellation ("Authorization: Bearer
	// <capacitat>"). It is given in this answer only (and in the replay of
	// the same request under its Idempotency-Key); the service keeps its
	// SHA-256.
	Capability string `json:"capacitat,omitempty"`
}

// withCapability returns the 201 body (as stored, without the capability)
// with capacitat c: the first answer and every replay go through it, so they
// are byte for byte the same.
func withCapability(body json.RawMessage, c string) json.RawMessage {
	var cr Created
	if c == "" || json.Unmarshal(body, &cr) != nil {
		return body
	}
	cr.Capability = c
	out, _ := json.Marshal(cr)
	return out
}

// answer is an HTTP status and JSON body, as stored for an Idempotency-Key.
type answer struct {
	Status int
	Body   json.RawMessage
	Replay bool // served from peticions_idempotents
}

// errDuplicateID: an order with this id exists (and no Idempotency-Key matched).
var errDuplicateID = errors.New("comandes: order id already exists")

// create stores o (already validated), its lines and comanda.creada in one
// transaction. With a non-empty key it is createKeyed: a retry with the same
// key returns the first answer and creates nothing, and a retry racing the
// first request waits for it. body is the request's, byte for byte: its hash
// tells a reused key with another body (answered 422), and with the key it
// seals the capability kept for the replay.
func (s *Service) create(ctx context.Context, o *Order, key string, body []byte) (answer, error) {
	if key != "" {
		return s.createKeyed(ctx, o, key, body)
	}
	if s.cfg.Authorizer != nil {
		if err := s.checkFree(ctx, o.ID); err != nil {
			return answer{}, err
		}
		if err := s.cfg.Authorizer.Authorize(ctx, o.ID, o.Total()); err != nil {
			switch {
			case errors.Is(err, ErrAuthConflict):
				return answer{}, err
			case errors.Is(err, ErrRefused):
				return answer{Status: 402, Body: errorBody(svc.CodePaymentRefused, "targeta", "payment refused: "+err.Error())}, nil
			}
			return answer{}, fmt.Errorf("%w: %w", errUnavailable, err)
		}
	}
	tx, err := s.cfg.Pool.Begin(ctx)
	if err != nil {
		return answer{}, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after Commit
	body, capability, err := s.insert(ctx, tx, o)
	if err != nil {
		return answer{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return answer{}, err
	}
	return answer{Status: 201, Body: withCapability(body, capability)}, nil
}

// insert writes o (with the SHA-256 of a new capability), its lines and
// comanda.creada in tx and returns the 201 body without the capability, and
// the capability.
func (s *Service) insert(ctx context.Context, tx pgx.Tx, o *Order) (json.RawMessage, string, error) {
	ev := &outbox.Event{Aggregate: Aggregate, AggregateID: o.ID, Type: TypeCreated, Version: o.Version(), Payload: o}
	capability, hash := newCapability()
	if err := insertOrder(ctx, tx, o, hash); err != nil {
		return nil, "", err
	}
	if err := s.cfg.Outbox.Enqueue(ctx, tx, ev); err != nil {
		return nil, "", err
	}
	body, _ := json.Marshal(Created{ID: o.ID, State: "creada", TotalCents: o.Total(), EventID: ev.ID.String(), Version: ev.Version})
	return body, capability, nil
}

func insertOrder(ctx context.Context, tx pgx.Tx, o *Order, capabilityHash []byte) error {
	var city, postal *string
	if o.Address != nil {
		city, postal = &o.Address.City, &o.Address.PostalCode
	}
	if _, err := tx.Exec(ctx, `INSERT INTO comandes (id, client, mercat, estat, import_centims, ciutat, codi_postal, hash_capacitat)
		VALUES ($1, $2, $3, 'creada', $4, $5, $6, $7)`, o.ID, o.Client, o.Market, o.Total(), city, postal, capabilityHash); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			return errDuplicateID
		}
		return err
	}
	b := &pgx.Batch{}
	for i, l := range o.Lines {
		b.Queue(`INSERT INTO linies_comanda (comanda_id, linia, producte, quantitat, preu_centims) VALUES ($1, $2, $3, $4, $5)`,
			o.ID, i+1, l.Product, l.Quantity, l.PriceCents)
	}
	return tx.SendBatch(ctx, b).Close()
}

// errorBody is an error answer stored under an Idempotency-Key (svc.ErrorBody).
func errorBody(code svc.Code, field, msg string) json.RawMessage {
	b, _ := json.Marshal(svc.NewErrorBody(code, field, msg))
	return b
}

func hashBody(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// HandlePaymentConfirmed is the consumer.Handler of pagament.confirmat
// (consumidor ConsumerPaymentConfirmed): in the consumer's transaction it sets
// estat = 'pagada' and writes comanda.pagada (versio 2 with the delivery
// address, 1 without) through the outbox. An order already paid changes
// nothing; an unknown order or a payload without comanda_id is permanent.
func (s *Service) HandlePaymentConfirmed(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	var p PaymentConfirmed
	if err := strictjson.Unmarshal(m.Envelope.Data, &p); err != nil {
		return outcome.Permanentf("esquema: pagament.confirmat: %v", err)
	}
	if p.OrderID == "" {
		return outcome.Permanentf("esquema: pagament.confirmat without comanda_id")
	}
	paid := Paid{ID: p.OrderID}
	var city, postal *string
	err := tx.QueryRow(ctx, `UPDATE comandes SET estat = 'pagada', pagada_en = now()
		WHERE id = $1 AND estat = 'creada' RETURNING client, mercat, import_centims, ciutat, codi_postal`, p.OrderID).
		Scan(&paid.Client, &paid.Market, &paid.TotalCents, &city, &postal)
	if errors.Is(err, pgx.ErrNoRows) {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM comandes WHERE id = $1)`, p.OrderID).Scan(&exists); err != nil {
			return err
		}
		if !exists {
			return outcome.Permanentf("comanda_desconeguda: %s", p.OrderID)
		}
		return nil // already paid: nothing to do
	}
	if err != nil {
		return err
	}
	if city != nil {
		paid.Address = &Address{City: *city, PostalCode: deref(postal)}
	}
	return s.cfg.Outbox.Enqueue(ctx, tx, &outbox.Event{Aggregate: Aggregate, AggregateID: p.OrderID, Type: TypePaid, Version: 1, Payload: paid})
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// PurgeRequests deletes the stored Idempotency-Key answers older than age
// and returns how many it deleted. A key reused after that is a new request.
func (s *Service) PurgeRequests(ctx context.Context, age time.Duration) (int64, error) {
	tag, err := s.cfg.Pool.Exec(ctx, `DELETE FROM peticions_idempotents WHERE creat_en < now() - $1::interval`,
		fmt.Sprintf("%d microseconds", age.Microseconds()))
	if err != nil {
		return 0, fmt.Errorf("comandes: purge idempotency keys: %w", err)
	}
	return tag.RowsAffected(), nil
}
