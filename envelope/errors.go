package envelope

import "github.com/km0/km0/outcome"

// permanent builds a DecodeError wrapped as an outcome.Permanent error, so that
// both errors.Is(err, ErrDecode) and outcome.IsPermanent(err) hold.
func permanent(field, reason string) error {
	return outcome.Permanent(&DecodeError{Field: field, Reason: reason})
}
