"""Converting weights from other frameworks: ordered rules from source names to Taktiny
names, a coverage check of every name before anything is loaded, and export back."""

from ._convert import check as check
from ._convert import convert as convert
from ._convert import export as export
from ._convert import round_trip_check as round_trip_check
from ._coverage import ConversionError as ConversionError
from ._coverage import ConversionProblem as ConversionProblem
from ._coverage import Report as Report
from ._coverage import Step as Step
from ._rules import Ignore as Ignore
from ._rules import Rule as Rule
from ._rules import Tie as Tie
from ._transforms import Transform as Transform
from ._transforms import cast as cast
from ._transforms import chain as chain
from ._transforms import concatenate as concatenate
from ._transforms import identity as identity
from ._transforms import reshape as reshape
from ._transforms import split as split
from ._transforms import stack as stack
from ._transforms import transpose as transpose
from ._transforms import unstack as unstack
