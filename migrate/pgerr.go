package migrate

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

func asPgErr(err error, target **pgconn.PgError) bool { return errors.As(err, target) }
