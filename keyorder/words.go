package keyorder

// The tables store a blocked key's reason and a parked message's state in
// the contract's Catalan (claus_bloquejades.motiu, missatges_aparcats.estat);
// these turn them into the English that people read in the CLI's and the
// console's output. Stored values and JSON keep the Catalan.

// English returns r as people read it: "waiting for a retry" or
// "dead-lettered"; an unknown reason as is.
func (r Reason) English() string {
	switch r {
	case ReasonRetry:
		return "waiting for a retry"
	case ReasonDeadLettered:
		return "dead-lettered"
	}
	return string(r)
}

// English returns s as people read it: "behind a retry", "behind a dead
// letter" or "dead-lettered as blocked"; an unknown state as is.
func (s State) English() string {
	switch s {
	case BehindRetry:
		return "behind a retry"
	case BehindDeadLetter:
		return "behind a dead letter"
	case DeadLetteredBehind:
		return "dead-lettered as blocked"
	}
	return string(s)
}
