package svc

import (
	"errors"
	"net/http"
)

// Code is the stable machine code (codi) of an error answer: clients test it,
// not the English message, which may change. The codes are the variables
// below, spelt in the contract's Catalan like its other identifiers, and
// docs/contract.md lists them (TestEveryCodeIsInTheContract); the zero Code is
// none, so every answer names one of them.
type Code struct{ name string }

// String returns the code as the body carries it, e.g. "id_invalid".
func (c Code) String() string { return c.name }

// The codes of the services' error answers, with the status they go with.
var (
	// CodeInvalidField (400): a member of the body, a query parameter or the
	// body as a whole (camp "cos") is malformed, missing or out of range;
	// camp names it.
	CodeInvalidField = Code{"camp_invalid"}
	// CodeInvalidID (400): an order id is not of the form P-YYYY-NNNNNN.
	CodeInvalidID = Code{"id_invalid"}
	// CodeUnknownMarket (400): the order's mercat is not one of the markets.
	CodeUnknownMarket = Code{"mercat_desconegut"}
	// CodeUnknownProduct (400): a line's producte is not stocked by inventari.
	CodeUnknownProduct = Code{"producte_desconegut"}
	// CodeUnknownParameter (400): a query parameter the endpoint does not take.
	CodeUnknownParameter = Code{"parametre_desconegut"}
	// CodeInvalidIdempotencyKey (400): the Idempotency-Key header is missing
	// where required, too long or not storable text.
	CodeInvalidIdempotencyKey = Code{"clau_idempotencia_invalida"}
	// CodeUnreadableBody (400): the body could not be read (the connection).
	CodeUnreadableBody = Code{"cos_illegible"}
	// CodeCredentialRequired (401): no credential, or not one that opens this.
	CodeCredentialRequired = Code{"credencial_requerida"}
	// CodePaymentRefused (402): the card was refused; nothing was stored.
	CodePaymentRefused = Code{"pagament_refusat"}
	// CodeUnknownOrder (404): no order of this id.
	CodeUnknownOrder = Code{"comanda_desconeguda"}
	// CodeOrderExists (409): an order of this id exists already.
	CodeOrderExists = Code{"comanda_existent"}
	// CodeAuthorisationConflict (409): pagaments holds another authorisation
	// for this order id; nothing was stored.
	CodeAuthorisationConflict = Code{"autoritzacio_en_conflicte"}
	// CodeBodyTooLarge (413): the body is over the endpoint's limit.
	CodeBodyTooLarge = Code{"cos_massa_gran"}
	// CodeNotJSON (415): a POST whose Content-Type is not application/json
	// (UTF-8).
	CodeNotJSON = Code{"cos_no_json"}
	// CodeUnknownHost (421): the request's Host does not name this server
	// (written by internal/hostguard, which spells it alike).
	CodeUnknownHost = Code{"host_desconegut"}
	// CodeIdempotencyKeyReused (422): the Idempotency-Key was used with
	// another body (another charge, at the gateway).
	CodeIdempotencyKeyReused = Code{"clau_idempotencia_reutilitzada"}
	// CodeCityNotCovered (422): repartiment does not deliver to the order's
	// city; nothing was stored or authorised. The same word is the motiu of
	// such a dead letter and cancellation.
	CodeCityNotCovered = Code{"ciutat_no_coberta"}
	// CodeKeyVoided (422): the gateway's charge key was voided by a refund.
	CodeKeyVoided = Code{"clau_anullada"}
	// CodeRefundRefused (422): the gateway refuses the refund: the charge
	// key is another order's, or was refunded under another key.
	CodeRefundRefused = Code{"reemborsament_refusat"}
	// CodeUnavailable (503): the service could not do it now (its database,
	// pagaments, the gateway); the same request may be sent again.
	CodeUnavailable = Code{"no_disponible"}
)

// Codes returns every Code, in the order of the table in docs/contract.md.
func Codes() []Code {
	return []Code{CodeInvalidField, CodeInvalidID, CodeUnknownMarket, CodeUnknownProduct, CodeUnknownParameter,
		CodeInvalidIdempotencyKey, CodeUnreadableBody, CodeCredentialRequired, CodePaymentRefused, CodeUnknownOrder,
		CodeOrderExists, CodeAuthorisationConflict, CodeBodyTooLarge, CodeNotJSON, CodeUnknownHost,
		CodeIdempotencyKeyReused, CodeCityNotCovered, CodeKeyVoided, CodeRefundRefused, CodeUnavailable}
}

// ErrorBody is the JSON body of every error answer:
// {"error": "<English>", "codi": "<code>", "camp": "<field>"}, camp only when
// one field is at fault.
type ErrorBody struct {
	Error string `json:"error"`
	// Code is the stable machine code (a Code's String): clients test it,
	// not the English message.
	Code  string `json:"codi"`
	Field string `json:"camp,omitempty"`
}

// NewErrorBody returns the body WriteError writes, for an answer stored to
// be replayed (an Idempotency-Key's 402).
func NewErrorBody(code Code, field, msg string) ErrorBody {
	return ErrorBody{Error: msg, Code: code.name, Field: field}
}

// WriteError writes {"error": msg, "codi": code, "camp": field} with status;
// field "" leaves camp out.
func WriteError(w http.ResponseWriter, status int, code Code, field, msg string) {
	WriteJSON(w, status, NewErrorBody(code, field, msg))
}

// WriteFieldError answers 400 for a body that did not decode or validate:
// a *FieldError with its Code (CodeInvalidField when it has none) and its
// Field; any other error CodeInvalidField without a field.
func WriteFieldError(w http.ResponseWriter, err error) {
	var fe *FieldError
	if !errors.As(err, &fe) {
		WriteError(w, http.StatusBadRequest, CodeInvalidField, "", err.Error())
		return
	}
	code := fe.Code
	if code == (Code{}) {
		code = CodeInvalidField
	}
	WriteError(w, http.StatusBadRequest, code, fe.Field, fe.Error())
}
